"""Output integrity: detect garbled output per prefill/decode pair and quarantine the pair.

Pure parts (no I/O, no HTTP imports): ``detectors`` (cheap checks run on every response), ``quarantine``
(per-pair scoring, quarantine and re-admission), ``divergence`` (two answers to one request: the same, apart by GPU
numerics, or different), ``consensus`` (reference answers for known-answer canaries).
"""
