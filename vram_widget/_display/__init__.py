"""Display: the Plotly figures, the Jupyter widget and the command line.

They show estimates and never compute one themselves: the widget's traits feed one observer
that asks the profile for an estimate and writes it into the figure in place.
"""
