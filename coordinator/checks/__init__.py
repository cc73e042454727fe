"""What an update must pass before it is accepted, and the compiled kernels that check and add it cheaply."""
