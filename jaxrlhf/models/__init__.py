"""Models: math only; placement is expressed through logical axis names."""
