"""Reference models: the one GPT that the plan command, the benchmarks, the tests and the example share (gpt.py)."""
