"""The trainer of the EAGLE-style draft head ("eagle"): collection, training, evaluation, export.

`tools/train_draft.py` is its command line (`cli.build_parser` and `cli.run`; the tool loads the target
through the llm backend, which this package does not import). What the head learns is what *the
target* says next, so every label comes from the target:

1. Self-distillation: the target answers instructions this module writes (chat: explain, list,
   summarize, compare, write a function...; raw code: Python stdlib function headers with their
   docstrings, to complete), greedy and at T=0.7, batched through `LlamaModel.forward` with a KV
   cache. The forward that generates a token also yields the hidden state and the distribution
   at that position, so the generation pass *is* the feature pass: nothing is run twice.
2. Text: windows of the Python standard library's source (`sysconfig.get_paths()["stdlib"]`) and
   documentation (`pydoc_data.topics`, docstrings), run through the target once (prefill).

Each position t gives (h_t = last hidden after the final norm, token t+1, the target's top-8 next-token
distribution at t+1, h_{t+1}). The head reads (h_t, embed(x_{t+1})), and is trained with soft
cross-entropy to the target's distribution (restricted to the draft vocabulary) plus smooth-L1
regression of its feature onto h_{t+1}, unrolled `--unroll` levels deep with its own features fed
back (what it does at drafting time; "training-time test"). The draft vocabulary is the
`--draft-vocab` tokens the target predicts most often in the collected data.

Phases are time-budgeted (`--gen-minutes`, `--text-minutes`, the rest of `--minutes` trains);
checkpoints are written every few minutes; held-out top-1 agreement with the target (10% of the
sequences, and separately instructions no template produces: "unseen") is printed per depth, and
the weights that did best on the unseen instructions are kept. The result is safetensors (fp16
layers + draft vocabulary; the LM head and embeddings are the target's, not stored) with metadata:
the target's fingerprint (`outrider_speculative.eagle.target_fingerprint`), config and a training
summary.

A tooling package, not a plugin: it registers nothing (no `outrider` entry point). It imports
`outrider_speculative`, whose head files it makes (the torch `DraftHead`, `save_head`, `HeadConfig`,
the fingerprint), and torch; no plugin imports it, so serving never loads the trainer.

- `features.py`   Features (what the target said at each position) and FeatureStore, top_k
- `corpus.py`     what the target is run on: instructions, stdlib code prompts, text windows (Prompt)
- `collection.py` running the target: generate (self-distillation), prefill_texts, collect
- `trainer.py`    the draft vocabulary, the train/held-out split, TrainConfig and Trainer
- `report.py`     a trained head's drafting cost and the summary stored with its weights
- `cli.py`        build_parser and run (tools/train_draft.py), compare (head shapes side by side)
- `progress.py`   log: timestamped progress lines
- `host_target.py` HostTarget: a target on the native runtime (Gemma) seen as a torch one
"""
