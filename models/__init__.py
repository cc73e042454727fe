"""FedMoE models: base-model loading (offline presets, local directories, the hubs) and fingerprints."""
