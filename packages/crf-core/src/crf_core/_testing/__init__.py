"""Test support for crf's own tests, docs examples and benchmarks (private: not API, may change without notice).

* :mod:`crf_core._testing.tiny_model` — offline tiny policies (a character tokenizer, a small Llama or Qwen2 built
  from a config), so nothing needs a model download.
"""
