"""The shared maths below every method: the grid spec (``grid``) and the tables its fields name,
observers, the fake-quantization arithmetic, number formats, the weight-method contract, the
grids and masks handed to export."""

from surgery.ops.numerics import observers  # noqa: F401 - the built-in observers a GridSpec's default names
