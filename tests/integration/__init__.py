"""Real multi-process launches (torchrun, gloo), the parity matrix, and the commands
as users run them."""
