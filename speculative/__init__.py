"""EAGLE-3 speculative decoding for the replica: drafts and acceptance rules. It never
runs the target: the engine's Speculator (replica/engine/speculation.py) calls it, the
Runner verifies.

head.py      the draft head (fc over three target layers, one decoder layer, reduced vocabulary), files
drafting.py  HeadState (the head's KV layer in the target's pool, committed vs draft), Drafter: chains and
             EAGLE-2 trees
verify.py    greedy acceptance and lossless multi-round rejection sampling; KV moves of the kept path
ngram.py     prompt-lookup drafter
policy.py    the measured draft shape per batch size
cache.py     where heads live
train.py     `python -m speculative.train`: self-distillation data (the engine with a feature hook),
             training-time test, checkpoints. A tool above the engine, not part of the library: it
             runs the target through replica's LLMEngine, and nothing else here (nor the engine)
             imports it (tests/test_layering.py places it with bench/)
"""
