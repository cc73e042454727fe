"""FedMoE worker."""
