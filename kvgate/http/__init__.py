"""The HTTP layer: routes, the one mapping from domain errors to responses, the decision log.

Everything here may import anything below it; nothing below imports it (see docs/architecture.md).
"""
