"""`flashdraft bench`: ar / hf / hf-lookup / dflash / llamacpp / llamacpp-dflash on the same prompts and machine.

datasets.py   prompts (JSONL or hub benchmarks) and multi-turn encoding
methods.py    one function per method (target, prompt ids, MethodSettings) → Sample, and the METHODS registry
variants.py   the sweep: drafter methods over --drafter × --block-size × --loop-stages × --loop-gate × --lookup ×
              --tree, llama.cpp methods over --gguf; stable labels
runs.py       the results directory (resumable) and the run loop
profile.py    the engines' cost profile (--profile)
report.py     summary numbers, summary.json, report.md, plots and the terminal table
The command line is flashdraft/cli/bench.py.
"""
