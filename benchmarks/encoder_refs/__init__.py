"""One module per built-in model with a reference encoder; see ``benchmarks/encoders.py``.

Each defines ``NAME`` (the model's registry name), ``REFERENCE`` (what it is compared with)
and ``build(depth=2) -> (ours, reference)``: two zero-argument callables running the encoder
on the same weights at the real published width, depth cut to ``depth``, on realistic inputs,
each returning the merged embeddings. ``build`` raises ImportError when the reference cannot
be imported here (the harness reports it as unavailable).
"""
