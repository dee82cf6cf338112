"""URLs of the example project: Django admin (the ledger's pages are in section "Keyed concurrency")."""

from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", RedirectView.as_view(url="/admin/celery_keyed_django/", permanent=False)),
]
