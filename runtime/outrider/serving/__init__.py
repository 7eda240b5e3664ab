"""Serving one model, module by job (who calls whom: docs/ARCHITECTURE.md):

- `request`: a request waiting for its single final reply (claim, reply, fail, chunk);
- `queue`: the bounded, fair queue in front of a model's instances;
- `scheduler`: the policy that hands an instance its next batch (default: one request);
- `instance`: the thread that owns one backend and runs what its scheduler hands it;
- `supervisor`: dead and hung instances noticed, answered for and replaced, with back-off;
- `served_model`: the model's state, health and way in (`submit`);
- `assembly`: a manifest and the plugin registry in, a ServedModel out.

Dependencies run one way: request <- queue <- scheduler <- instance <- supervisor <- served_model
<- assembly (which also knows the worker proxy). Nothing here imports the server or a front.
"""
