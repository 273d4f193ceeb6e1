"""A replica kind of its own: speaks the real internal protocol with no model
(deterministic streams, crash/lag/freeze/refuse) for the proxy's tests and load."""
