"""FedMoE coordinator."""
