"""Models larger than memory: offloaded models, their work folders and manifests."""
