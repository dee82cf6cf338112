"""URLs of the example project: Django admin (the ledger's pages are in section "Keyed concurrency")."""

from django.contrib import admin
from django.urls import path
from django.views.generic import RedirectView

# The host project names its admin; an operations console for the ledger reads better than "Django administration".
admin.site.site_header = "celery-keyed operations"
admin.site.site_title = "celery-keyed"
admin.site.index_title = "Shop and keyed concurrency"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("", RedirectView.as_view(url="/admin/celery_keyed_django/", permanent=False)),
]
