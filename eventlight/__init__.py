"""eventlight: train AI agents from their traces on an event-sourced store."""
