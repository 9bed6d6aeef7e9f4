"""What protects the port: connection deadlines and caps, the API key, bounded bodies."""
