"""Placement: device groups, layouts, execution plans, reallocation, cost and search."""
