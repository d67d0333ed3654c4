"""Failfast inside other inference engines."""
