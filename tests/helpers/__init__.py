"""What several test modules share: fixtures, tiny models and servers, requests (no test module imports another)."""
