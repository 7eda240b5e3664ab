"""What more than one backend needs to serve an ONNX graph, in the core so no plugin imports another.

- `export`: the torch -> ONNX export of a task's module, run as `python -m outrider.onnx.export`
  (torch is imported inside its functions, and only in that subprocess);
- `artifact`: `onnx_model(manifest)`, the graph a manifest names or its cached export;
- `profiles`: the TensorRT optimization profile bounds a manifest allows, and running a call
  with more rows in pieces.

The ONNX Runtime and TensorRT plugins use all three. Importing this package imports nothing.
"""
