"""Torch-free contracts both processes share: the internal protocol, block hashing,
OpenAI schemas and metrics primitives. Imports msgspec, xxhash and the stdlib only."""
