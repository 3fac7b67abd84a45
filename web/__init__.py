"""Static assets of the admin page (a data package: see appliance/http/assets.py)."""
