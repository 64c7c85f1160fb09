"""Deployment: the export verb, its round-trip summary, and formats/ (one file per format)."""
