"""The backend-neutral generation contract and engine, on numpy (no torch: a model may use it).

- `contract`  what a generating model implements (`CausalLM`, slot `KVCache`, `Chunk`), what a
              drafter reads and returns (`SequenceView`, `DraftTree`, `SpecTree`), and what a
              decode strategy answers each step (`DecodeStrategy`)
- `sampling`  request parameters and `target_distribution`, the one definition of what the
              target samples from
- `verify`    the lossless accept rules (greedy and multi-candidate speculative sampling)
- `engine`    `GenerationEngine`: continuous batching over any `CausalLM` + tokenizer, asking an
              optional `DecodeStrategy` for drafts; `GenerationScheduler` feeds it from a queue
- `sequence`  `Sequence`, one generation in flight (the `SequenceView` drafters read)
- `request_reader`  a generate request's parameters, prompt tokens and token rules, checked
              before it takes a slot
- `drafting`  a decoding sequence's draft: the grammar's forced tokens or the strategy's tree
- `prefix_sharing`  how sequences reuse and store prompt prefixes in the `prefix_cache`
- `text`      incremental detokenization with stop strings

A generating backend provides a `CausalLM` and a tokenizer and reuses all of this; a decode
strategy (the `speculative` accelerator) reads only this package, never a backend plugin.
"""
