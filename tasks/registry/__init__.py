"""The MLflow registry: tracking, registration, promotion, the version page, the config
schema, exports to serving engines, and the serving-side reader of the champion config."""
