"""The shared maths below every method: the grid spec and observers, number formats, the weight-method contract, the grids and masks handed to export."""
