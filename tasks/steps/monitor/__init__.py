"""Production talks back: serving deployments scraped, their acceptance checked against the
champion's promise. Importing this package imports none of its modules."""
