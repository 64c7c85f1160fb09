"""The library's foundation: handles, guarded weight transforms, selection, inputs, capture, registries."""
