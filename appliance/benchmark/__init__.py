"""`appliance benchmark`: measure this box, advise the settings, apply them."""
