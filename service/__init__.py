"""Service."""
