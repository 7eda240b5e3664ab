"""Running an ORT session through I/O binding (`IoBinding`): on a GPU, inputs and outputs go
through device buffers that later calls of the same shapes reuse."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

#: device buffer sets kept per instance, one per distinct set of input shapes (least recently used goes)
BOUND_SHAPES_KEPT = 16


class IoBinding:
    """One session's I/O binding and the device buffers it keeps, on `device` (kind, index)."""

    def __init__(self, session: Any, output_names: list[str], device: tuple[str, int]) -> None:
        self.session = session
        self.output_names = output_names
        self.device = device
        self.binding: Any = session.io_binding()
        #: input shapes -> (input OrtValues, output OrtValues or None): device buffers kept for reuse
        self.buffers: OrderedDict[tuple, tuple[dict[str, Any], Optional[list[Any]]]] = OrderedDict()
        self.lock = threading.Lock()

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run through I/O binding: inputs copied into device buffers kept per set of input shapes
        (`update_inplace`, no new allocation), outputs written into buffers kept the same way."""
        from onnxruntime import OrtValue

        kind, index = self.device
        feeds = {name: np.ascontiguousarray(a) for name, a in feeds.items()}
        shapes = tuple((name, a.shape, a.dtype.str) for name, a in feeds.items())
        with self.lock:
            buffers = self.buffers.pop(shapes, None)
            if buffers is None:
                # Buffers of their own: on the CPU, ortvalue_from_numpy would alias the caller's
                # array, and the next call's update_inplace would overwrite it.
                buffers = ({name: OrtValue.ortvalue_from_shape_and_type(a.shape, a.dtype, kind, index)
                            for name, a in feeds.items()}, None)
            for name, a in feeds.items():
                buffers[0][name].update_inplace(a)
            binding = self.binding
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            for name, value in buffers[0].items():
                binding.bind_ortvalue_input(name, value)
            for i, name in enumerate(self.output_names):
                if buffers[1] is None:
                    binding.bind_output(name, kind, index)  # ORT allocates it once, on this device
                else:
                    binding.bind_ortvalue_output(name, buffers[1][i])
            self.session.run_with_iobinding(binding)
            if buffers[1] is None:
                buffers = (buffers[0], binding.get_outputs())
            self.buffers[shapes] = buffers
            while len(self.buffers) > BOUND_SHAPES_KEPT:
                self.buffers.popitem(last=False)
            return dict(zip(self.output_names, binding.copy_outputs_to_cpu()))

    def close(self) -> None:
        """Drop the device buffers and the binding; ORT frees their memory with them."""
        with self.lock:
            self.buffers.clear()
            self.binding = None
