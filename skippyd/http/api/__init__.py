"""The HTTP routes and what a request needs before it is submitted."""
