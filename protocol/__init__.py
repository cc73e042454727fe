"""FedMoE protocol."""
