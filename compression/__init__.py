"""FedMoE compression."""
