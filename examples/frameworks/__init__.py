"""Agents written with ordinary frameworks, trained by eventlight without changing their code."""
