"""FedMoE coordinator: access."""
