"""Process instances: a backend in a worker process (`scheduling.instance_kind: process`).

`proxy.WorkerBackend` is the server's side (a Backend that forwards each call); `child` is the
worker's side (`python -m outrider.worker`); `wire` is what both speak.
"""
