"""FedMoE coordinator: checks."""
