"""The GPU check's dated page and summary (:mod:`~gpu_check.page.markdown`) and its section on the ``auto``
defaults (:mod:`~gpu_check.page.defaults`)."""
