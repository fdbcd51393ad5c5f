"""`fedsynth generator evaluate`: a judge trained on real data scores generated images (recognizability, CAS, a
Fréchet distance in the judge's feature space). `judge.py` trains and caches the judge, `metrics.py` holds the
figures, `sources.py` fetches the images to score (a served generator, a backend started in this process, or a file).
"""
