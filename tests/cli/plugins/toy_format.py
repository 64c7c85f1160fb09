"""A user's export format, one file: the weights as NumPy arrays in an .npz archive."""

import numpy as np

import surgery


def write_npz(model, path, options):
    with open(path, "wb") as file:
        np.savez(file, **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items()})


surgery.register_export_format(
    surgery.ExportFormat("npz", write_npz, load=lambda path: dict(np.load(path)), suffix="npz")
)
