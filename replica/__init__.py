"""Model replica: engine process + API process. Keep this module free of heavy imports."""
