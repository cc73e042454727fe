"""FedMoE coordinator: storage."""
