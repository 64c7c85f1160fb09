"""The library's foundation: handles, guarded weight transforms, selection, inputs, capture, registries."""

import logging

# A library logs to its own logger and the application decides where it goes (the CLI's Hydra
# logging, or the user's logging.basicConfig): no message falls through to Python's last resort.
logging.getLogger("surgery").addHandler(logging.NullHandler())
