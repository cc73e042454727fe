"""FedMoE coordinator: api."""
