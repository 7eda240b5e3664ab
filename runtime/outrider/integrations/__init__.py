"""Integrations with engines users already run (`outrider.integrations.ray`: Ray Serve).

Each integration is a module of its own that imports its engine when it is imported; nothing
here is imported by `import outrider`, and the engines are optional extras (`outrider[ray]`).
"""
