"""Development tools, not shipped to serving pods: synthetic checkpoints and the benchmark.

They use the product's own header codec and architecture table; the runtime stager never
imports them (``modelstage demo`` and ``modelstage bench`` import them lazily).
"""
