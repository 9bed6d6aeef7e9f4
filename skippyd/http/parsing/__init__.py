"""Request bodies into typed parameters; parsing changes no state."""
