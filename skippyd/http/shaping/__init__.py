"""One generation's events into what the API returns."""
