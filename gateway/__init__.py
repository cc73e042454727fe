"""FedMoE gateway."""
