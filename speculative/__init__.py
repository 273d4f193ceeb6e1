"""EAGLE-3 speculative decoding for the replica.

head.py      the draft head (fc over three target layers, one decoder layer, reduced vocabulary), files
drafting.py  HeadState (the head's paged KV, committed vs draft), Drafter: chains and EAGLE-2 trees
verify.py    greedy acceptance and lossless multi-round rejection sampling; KV moves of the kept path
ngram.py     prompt-lookup drafter
decode.py    the standalone speculative loop over the target and a paged pool; the engine's reference
pool.py      the paged KV pool that loop uses
train.py     `python -m speculative.train`: self-distillation data, training-time test, checkpoints
"""
